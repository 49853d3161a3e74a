"""The ``qwen35`` architecture (Qwen3.5 / 3.6 dense hybrids), plain PyTorch.

Every ``full_attention_interval``-th layer (``(i + 1) % interval == 0``) is gated full attention;
the others are Gated DeltaNet (GDN). GGUF facts, from llama.cpp's converter (and undone the same
way by transformers' ``integrations/gguf/gguf_conversion_mapping.py::_qwen35``):

* ``attn_norm``, ``post_attention_norm``, ``output_norm``, ``attn_q_norm``, ``attn_k_norm`` hold
  ``1 + w`` (multiplied directly); ``ssm_norm`` holds ``w`` of the gated RMSNorm
  ``rmsnorm(o) * w * silu(z)`` per value head.
* ``ssm_a`` holds ``-exp(A_log)``; ``ssm_dt.bias`` is ``dt_bias``;
  ``g = ssm_a * softplus(x @ ssm_alpha + dt_bias)``, ``beta = sigmoid(x @ ssm_beta)``.
* ``attn_qkv`` is the GDN in-projection ``[q | k | v]``, ``attn_gate`` is ``z``, ``ssm_conv1d`` is
  ``[channels, K]``: causal depthwise conv + SiLU over ``[q | k | v]``; q and k are L2-normalised
  per head, q scaled by ``1/sqrt(Dk)``.
* Value heads are stored **tiled** (``v0k0, v0k1, ...``): we keep that order everywhere and map
  value head ``j`` to key head ``j mod Hk`` (HF's grouped order would be ``j // (HV/Hk)``).
* Attention layers: ``attn_q`` rows hold per head ``[query(D) | gate(D)]``; q/k RMS-normed per
  head; rotary on the first ``rope.dimension_count`` dims in NeoX halves (text positions make
  Qwen3.5's interleaved mrope equal to plain rope); output times ``sigmoid(gate)``.
* ``block_count`` includes ``nextn_predict_layers`` MTP blocks, which are skipped.

State and rollback (DESIGN.md): a forward never writes the session's state. Prefill (``parents
is None``) runs the chain and returns the final recurrent state and conv tail, which
:meth:`Qwen35Model.commit` installs. Verify over a tree returns per-node values and
:meth:`commit` builds the state of the accepted path; two strategies are implemented:

* ``"gather"``: the tree forward keeps every node's recurrent state ``[T, HV, Dk, Dv]`` and
  commit copies the last path node's state.
* ``"recompute"``: the tree forward keeps each node's ``(k, v, g, beta)`` (a few KB) and commit
  re-runs the recurrence from the committed state along the accepted path only (``k + 1``
  steps, one pass per layer that reads and writes the state once).

Measured with ``python -m target_service.bench_rollback`` (one GDN layer at Qwen3.5-0.8B
dimensions, HV = 16, Dk = Dv = 128; a tree of T nodes, an accepted path of n nodes; verify +
commit; ``benchmarks/rollback-{cpu,cuda}.txt``). Milliseconds per step, gather / recompute:

=====  ==  ===============  ==============  ======================
T      n   CPU (2 threads)  H200 (CUDA)     state MB moved (g / r)
=====  ==  ===============  ==============  ======================
4      4   1.75 / 2.62      0.72 / 1.35     6.0 / 2.1
16     1   5.20 / 5.71      2.72 / 2.12     18.0 / 2.0
16     16  6.42 / 8.03      2.39 / 5.32     18.0 / 2.3
32     32  27.8 / 35.1      5.29 / 9.36     34.0 / 2.5
=====  ==  ===============  ==============  ======================

Choice: **gather**. In this reference the tree recurrence materialises every node's state to
compute the node outputs anyway, so gather's commit is one state copy while recompute re-runs
``n`` updates: gather is faster in 23 of the 26 measured (T, n, device) cases, by up to 2.2x
(T = n = 16, H200); recompute wins T = n = 1 and T = n = 8 on the CPU (within that machine's
noise) and T = 16, n = 1 on the H200 (2.12 vs 2.72 ms). Recompute moves ``(T + 2) / 2`` times fewer state bytes; that pays off
only once a fused tree kernel stops writing per-node states, so it stays implemented, tested
for exactness (tests/test_qwen35.py) and selectable (``Qwen35Model(..., rollback="recompute")``).

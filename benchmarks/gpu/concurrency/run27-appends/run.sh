# The drafter's eager appends replayed as CUDA graphs (session 27): this tree ("new") against
# .peer/old.tar.gz ("old": a git archive of c7e6f73, the appends eager), with llama-batched-bench
# first: benchmarks/gpu/concurrency/run25-staging/run.sh, which takes the same ROUNDS, ORDER,
# LEVELS, LLAMA and TAG (its header says what to carry; the SmolLM2 file now goes in five parts,
# tools/gpu_run.sh).
exec bash benchmarks/gpu/concurrency/run25-staging/run.sh "$@"

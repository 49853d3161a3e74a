# The feature ring's copies inside the captured steps (session 26): this tree ("new") against
# .peer/old.tar.gz ("old": a git archive of 3290d33, the ring read and store launched from the host
# around each step), with llama-batched-bench first: benchmarks/gpu/concurrency/run25-staging/run.sh,
# which takes the same ROUNDS, ORDER, LEVELS, LLAMA and TAG (its header says what to carry).
exec bash benchmarks/gpu/concurrency/run25-staging/run.sh "$@"

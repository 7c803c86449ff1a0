"""What the benchmarks share: the stack of processes a live run brings up (`stack`), its
load generators (`recorder`, `firehose`) and records (`measured`), the raw JetStream
baseline (`raw`), the command line and result files (`cli`), the naive baseline's worker
(`naive_worker`), py-spy sampling (`pyspy`), and readings of processes, machines and
traces."""

"""fairq's benchmarks, grouped by what they run on (bench/README.md): `scenarios` (the live
stack), `sim` (the simulator), `chaos` (faults under load), `micro` (one part alone),
`archive` (one-off studies whose figures are in docs/benchmarks.md), and `harness` (what
they share)."""

"""One-off studies that settled a decision. Their figures are recorded in
docs/benchmarks.md, which cites them; they still run, to check a figure again."""

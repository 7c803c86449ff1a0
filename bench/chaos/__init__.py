"""Chaos under load: worker processes (`workers`) or dispatchers and broker nodes (`ha`)
struck while a load (`load`) runs, an observer (`watch`) recording what it cost. Run
`python -m bench.chaos.run`."""

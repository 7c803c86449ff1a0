"""Studies in the simulator (`dispatcher.sim`): the scheduling core and placement on a
virtual clock with a modelled engine, no processes and no broker."""

"""High availability: one dispatcher dispatches, standbys wait.

`lease.py` is one process's hold on the deployment's lease (the key and its epoch fence
are `broker_config.lease_key`); `tenures.py` runs one `Dispatcher` after another on one
connection, so a lost lease or a broker failure becomes a new tenure that stands by.
"""

"""What the tests share: worker groups and the processes they start (group.py, zygote.py,
worker_main.py), the functions workers run by reference (helpers.py and one module per
area), and the entry points tests start as ``python -m tests.support.NAME``."""

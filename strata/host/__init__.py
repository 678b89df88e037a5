"""The host process's composition root (root.py) and its headless front end (serve.py).

Both front ends, `strata serve` and the tray, build their parts through root.Host: the
service, its rules and the HTTP runner, from one read of the configuration. Qt-free and
torch-free; the only package that imports both engine/service and engine/api.
"""

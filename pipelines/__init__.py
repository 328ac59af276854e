"""Ray Data job graphs. Each module builds and runs one job; the CLIs in
``prx_data`` parse arguments and call these."""

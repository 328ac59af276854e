"""Download: URL-only rows become image rows in the table (the img2dataset step).

:mod:`prx_data.download.fetch` fetches one URL safely (address policy,
limits, retries, checks); :mod:`prx_data.download.job` is the column job
that fills a table (``python -m prx_data.download``).
"""

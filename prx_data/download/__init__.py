"""Download: URL-only rows become image rows in the table (the img2dataset step).

:mod:`prx_data.download.fetch` fetches one URL safely (address policy,
limits, retries, checks). The job that fills a table with it
(``python -m prx_data.download``) is :mod:`prx_data.pipelines.download`.
"""

#: The fetcher is a module: ``from prx_data.download import fetch``.
__all__ = [
    "fetch",
]

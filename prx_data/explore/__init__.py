"""The web explorer: browse, search and filter a Lance table (loopback by default)."""

from prx_data.explore.app import ExploreConfig, Explorer, serve

__all__ = ["ExploreConfig", "Explorer", "serve"]

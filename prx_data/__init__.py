"""prx-data: image-text collections -> Lance -> bucketed MDS -> Composer streams."""

__version__ = "0.1.0"

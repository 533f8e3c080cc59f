"""tttvideo: long video generation with Test-Time Training layers."""

__version__ = "0.1.0"

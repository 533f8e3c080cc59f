"""tttvideo: long video generation with Test-Time Training layers.

    import tttvideo
    result = tttvideo.train("configs/demo.toml")
    video = tttvideo.VideoPipeline.from_run(result.output_dir)(["a red circle moves left on a blue background"])

See `tttvideo.api`.
"""

__version__ = "0.1.0"

# The API pulls in torch; `tttv --help` and `tttv config` should not pay for it, so it loads on first use.
_API = ("VideoPipeline", "Video", "train", "as_config")


def __getattr__(name: str):
    if name in _API:
        from tttvideo import api

        return getattr(api, name)
    raise AttributeError(f"module 'tttvideo' has no attribute {name!r}")


__all__ = ["__version__", *_API]

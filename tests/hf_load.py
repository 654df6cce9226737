"""Loading what fsdpp wrote with transformers as a user would, keeping every warning
transformers gives meanwhile: an unknown, missing or out-of-range config key, a weight the
model lacks or does not use. The tests require none."""
import logging
import warnings


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def load_quietly(auto_class, path, **kwargs):
    """(model, warnings): `auto_class.from_pretrained(path, **kwargs)` and each warning that
    transformers logged or raised while it loaded, as text."""
    kept = _Kept()
    logger = logging.getLogger("transformers")  # every transformers module logs below it
    logger.addHandler(kept)
    try:
        with warnings.catch_warnings(record=True) as raised:
            warnings.simplefilter("always")
            model = auto_class.from_pretrained(path, **kwargs)
    finally:
        logger.removeHandler(kept)
    return model, kept.messages + [str(w.message) for w in raised]

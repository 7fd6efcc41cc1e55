"""The configuration schema and its checks (see schema.py)."""

# @settings stores the optimizers', datasets' and models' options in Hydra's ConfigStore, where
# conf/optimizer/, conf/dataset/ and conf/model/ take them from.
from ..data import dart, e2e, hf  # noqa: F401
from ..models import settings as model_settings  # noqa: F401
from ..optim import settings as optimizer_settings  # noqa: F401
from .compose import compose_config
from .schema import ConfigError, Option, validate

__all__ = ["ConfigError", "Option", "compose_config", "validate"]

"""Level types: one class each, behind the capability interface of ``base.Level``."""
from .base import Level, LevelStorage, LevelSymbols, PackedLevel, packed_level
from .compressed import Compressed
from .dense import Dense
from .fixed import Fixed
from .singleton import Singleton

#: level type name in the format text -> class
LEVEL_TYPES = {cls.name: cls for cls in (Dense, Compressed, Singleton, Fixed)}

__all__ = ["Level", "LevelStorage", "LevelSymbols", "PackedLevel", "packed_level", "Dense", "Compressed", "Singleton",
           "Fixed", "LEVEL_TYPES"]

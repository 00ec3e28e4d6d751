"""The architectures Strata ships, one module each; importing this package registers them all.

A module added here is found and imported without being listed anywhere.
"""

import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

"""The hooks' core: what every framework package shares and the layers below the instrumentors
use (the adapter interface, the choice of adapter, patching, guest hooks and module attributes
that user objects never see, version checks, the pipeline position). Imports no instrumentor:
the registry loads the framework packages' light `__init__.py` by name, when first asked."""

"""Adapters that plug llmkernels into other libraries' extension points (optional dependencies, imported lazily)."""

__all__: list[str] = []  # each adapter is a submodule, imported by name (its library is optional)

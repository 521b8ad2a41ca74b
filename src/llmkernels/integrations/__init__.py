"""Adapters that plug llmkernels into other libraries' extension points (optional dependencies, imported lazily)."""

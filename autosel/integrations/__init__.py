"""Optional integrations with model libraries; each module imports its library only when it is imported."""

"""Environment variable names that several host modules read: a leaf module, so the settings
and the before-load hook (which must not pass the key on) share them without an import cycle."""

API_KEY_ENV = "STRATA_API_KEY"  # the server's API key, kept off command lines

"""Drop-in integrations with training frameworks."""

"""The nanoserve router: prefix- and load-aware routing of Generation requests over engine
services. Never imports torch (its pod has none)."""

"""The runtime: everything that touches torch, in four folders by job (docs/architecture.md)."""

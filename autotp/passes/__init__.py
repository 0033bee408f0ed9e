"""Graph passes (installed as autotp.passes): capture -> strategies -> solve -> rewrite."""

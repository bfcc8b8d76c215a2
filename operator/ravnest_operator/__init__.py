"""The Ravnest Kubernetes operator: turns RavnestJob resources into provider pods and keeps an
honest status. It depends on the `ravnest` engine; the engine never imports it."""

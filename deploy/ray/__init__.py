"""cpserve on Ray: ``python -m deploy.ray.launch`` and ``deploy.ray.launch.launch(config)``.

Kept free of imports so that ``python -m deploy.ray.launch`` loads the module once.
"""

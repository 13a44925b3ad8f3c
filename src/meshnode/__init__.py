"""meshnode: adapt a pretrained causal LLM on a swarm of weak peers joined by internet links.

The package is layered (a lower layer never imports a higher one)::

    compression, optim  <  model, data  <  stage  <  protocol  <  node, mesh  <  cli

``config`` sits below all of them: plain dataclasses and a TOML loader, no torch.
"""

__version__ = "0.1.0"

"""SOMA's clustering, routing and sampling: from a corpus to clusters, from a context to experts.

Owns the c-BTM clustering of the corpus (cluster), the top-k router, ensembles and routed
evaluation (routing), and sampling from a routed ensemble (sample). Forwards run on the Ops they
are handed (default the CPU engine). May import the foundation, zosoma.model, zosoma.formats and
zosoma.engines.
"""

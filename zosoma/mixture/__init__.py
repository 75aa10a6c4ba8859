"""The mixture of experts: from a corpus to clusters, from a context to experts, routed text.

Owns the c-BTM clustering of the corpus into one cluster per expert (cluster), the top-k router,
ensembles and routed evaluation (routing), and sampling from a routed ensemble (sample). SOMA
runs (zosoma.runs.soma) use it to train and evaluate experts. Forwards run on the Ops they are
handed (default the CPU engine). May import the foundation, zosoma.model, zosoma.formats and
zosoma.engines.
"""

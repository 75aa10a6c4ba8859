"""Orthogonal probes (Choromanski et al., "Structured Evolution with Compact Architectures for
Scalable Policy Optimization", ICML 2018): the step's P i.i.d. directions orthogonalised
(Gram-Schmidt, as the QR factorisation of the (d, P) block with R's diagonal made positive) and
each rescaled to norm sqrt(d), the expected norm of an i.i.d. direction. With P > d the
directions come in orthogonal blocks of d. Orthogonal probes sample the sphere more evenly than
independent ones: the estimate's variance falls at the same P (Choromanski et al., Theorem 3).
"""

from __future__ import annotations

import numpy as np

from zosoma.strategies.probes.design import Design, counter_directions


class Orthogonal(Design):
    def directions(self, pop, layout, d: int, state: dict) -> np.ndarray:
        G = counter_directions(pop, d).astype(np.float64)  # (P, d)
        U = np.empty_like(G)
        for start in range(0, pop.P, d):  # blocks of at most d orthogonal rows
            q, r = np.linalg.qr(G[start:start + d].T)  # (d, p), (p, p)
            q *= np.where(np.diag(r) < 0, -1.0, 1.0)  # the unique Q of Gram-Schmidt
            U[start:start + d] = q.T * np.sqrt(d)
        return U.astype(np.float32)

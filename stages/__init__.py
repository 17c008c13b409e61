"""Stage kinds and their implementations: plain functions, no Prefect.

One subpackage per stage kind (``load``, ``design``, ``normal_equations``,
``solve``, ``train``, ``model``, ``write``), each holding its implementations; the
machinery every kind shares (runner, registry, store, hashing, versions,
tiles, paths, the agreement bound) lives apart in ``engine``. Importing this
package loads each kind's contract; the implementations register on the registry's
first use (``stages/engine/registry.py``), so reading configs never imports torch.
"""

from gridsolve.stages import design, load, model, normal_equations, solve, train, write

__all__ = ["design", "load", "model", "normal_equations", "solve", "train", "write"]

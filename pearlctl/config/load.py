"""Reading a run spec: ``load_spec`` reads a TOML file, ``parse_spec`` validates a decoded document whole
(pearlctl.config.tables) and makes the ``RunSpec`` the rest of pearlctl reads. Either raises one SpecError
with every problem found, each at its key path with what would be valid, before anything is submitted or
written to state. Checks that need the cluster (does ``sinfo`` know the partition, do its nodes have that many
GPUs) are made by the launcher against the RunSpec; everything here is pure but for reading the spec, its
model path and its profile.
"""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pearlctl import vocabulary
from pearlctl.config.problems import SpecError, SpecProblem
from pearlctl.config.spec import PoolSpec, RouterSpec, RunSpec

if TYPE_CHECKING:
    from pearlctl.config.tables import Pool


def load_spec(
    path: str | Path,
    known_policies: tuple[str, ...],
    overrides: dict[str, Any] | None = None,
    *,
    model_on_this_host: bool = True,
) -> RunSpec:
    """Read and validate a spec file (``model_on_this_host``: ``parse_spec``'s). Unreadable or malformed files
    raise SpecError too.

    ``overrides`` replace keys of ``[run]`` (command-line ``--name``, ``--run-dir``, ``--backend``) before
    validation, so they are checked like the file; give paths in them absolute.
    """
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise SpecError(str(source), [SpecProblem("<file>", f"cannot read: {exc.strerror or exc}")]) from exc
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(str(source), [SpecProblem("<file>", f"not valid TOML: {exc}")]) from exc
    if overrides:
        run = data.get("run")
        if isinstance(run, dict):
            run.update(overrides)
    return parse_spec(data, source, known_policies, model_on_this_host=model_on_this_host)


def parse_spec(
    data: dict[str, Any], source: Path, known_policies: tuple[str, ...], *, model_on_this_host: bool = True
) -> RunSpec:
    """Validate a decoded TOML document. Raises SpecError listing every problem. ``model_on_this_host=False``
    (`launch --dry-run`): a model path missing here is a warning in ``RunSpec.warnings``, not a problem — it may
    exist only on the compute nodes; a real launch refuses it."""
    # here, not at the top: every CLI command imports this package, and only reading a spec needs pydantic
    from pydantic import ValidationError

    from pearlctl.config.errors import problems_from
    from pearlctl.config.tables import Document, SpecContext

    context = SpecContext(base=source.parent, policies=known_policies, model_on_this_host=model_on_this_host)
    try:
        document = Document.model_validate(data, context=context)
    except ValidationError as exc:
        raise SpecError(str(source), [*problems_from(exc, Document), *context.problems]) from None
    if context.problems:
        raise SpecError(str(source), context.problems)
    present = document.pools.present()
    pools = {kind: _pool_spec(kind, present[kind]) for kind in data["pools"]}  # in the spec's order
    return RunSpec(
        **document.run.model_dump(),
        pools=_borrowed_engine_args(pools),
        source=source.resolve(),
        router=RouterSpec(**document.router.model_dump()),
        warnings=tuple(context.warnings),
    )


def _pool_spec(kind: str, pool: Pool) -> PoolSpec:
    fields = pool.model_dump()
    for key in ("command", "train_command"):
        fields[key] = tuple(fields[key]) if fields[key] else None
    fields["model"] = str(fields["model"]) if fields["model"] is not None else None
    return PoolSpec(name=kind, **fields)


def _borrowed_engine_args(pools: dict[str, PoolSpec]) -> dict[str, PoolSpec]:
    """A trainer pool that sets no ``engine_args`` gets its rollout pool's (else its elastic pool's): the vLLM
    workers on its borrowed GPUs then serve what the rollout workers serve (the same ``max_model_len``, so a
    turn that fits one fits the other)."""
    trainer = pools.get(vocabulary.PoolKind.TRAINER)
    source = pools.get(vocabulary.PoolKind.ROLLOUT) or pools.get(vocabulary.PoolKind.ELASTIC)
    if trainer is None or trainer.engine_args or source is None or not source.engine_args:
        return pools
    return {**pools, vocabulary.PoolKind.TRAINER: dataclasses.replace(trainer, engine_args=dict(source.engine_args))}

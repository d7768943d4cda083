#!/usr/bin/env bash
# The checks CI runs before the tests (CONTRIBUTING.md): ruff's lint and format check, then mypy, strict on src/
# and loose on tests/.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check src tests benchmarks
.venv/bin/ruff format --check src tests benchmarks
.venv/bin/mypy
# tests/ reach into concrete runtimes through protocol-typed handles (a LoadedModel's model is a CausalLM, its
# tokenizer optional): mypy checks their imports, names and call arities, not their narrowing
.venv/bin/mypy tests --allow-untyped-defs --allow-incomplete-defs --no-check-untyped-defs --no-warn-unused-ignores \
    --disable-error-code=union-attr --disable-error-code=attr-defined --disable-error-code=arg-type \
    --disable-error-code=operator --disable-error-code=index --disable-error-code=var-annotated \
    --disable-error-code=assignment --disable-error-code=return-value --disable-error-code=misc \
    --disable-error-code=method-assign --disable-error-code=type-var

"""The long bench commands' options are declared once (``kvstore.cli.bench_vllm_options``,
``kvstore.cli.bench_multidoc_options``): each fills fields of the options dataclasses and takes their defaults, and
these tests fail where the table and the dataclasses, or the table and the command, disagree."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import pytest
import typer

from kvstore.bench.multidoc_options import BenchMode, MultiDocOptions
from kvstore.cli import bench_multidoc_options, bench_vllm_options
from kvstore.cli.bench_blend import multi_doc_qa_command, shuffle_command
from kvstore.cli.bench_vllm import bench_vllm_command
from kvstore.cli.declared_options import CliOption, target_default
from kvstore.config import parse_tiers

TABLES: list[tuple[Sequence[CliOption], Mapping[type, tuple[str, ...]], Sequence[str]]] = [
    (bench_vllm_options.BENCH_VLLM_OPTIONS, bench_vllm_options.NOT_OPTIONS, ()),
    (
        bench_multidoc_options.MULTIDOC_OPTIONS,
        bench_multidoc_options.NOT_OPTIONS,
        tuple(bench_multidoc_options.PARSED_OPTIONS.values()),
    ),
]


@pytest.mark.parametrize(("table", "not_options", "parsed"), TABLES)
def test_every_field_is_an_option_or_named_as_none(
    table: Sequence[CliOption], not_options: Mapping[type, tuple[str, ...]], parsed: Sequence[str]
) -> None:
    for options_class, exempt in not_options.items():
        filled = {t.field_name for option in table for t in option.targets if t.options_class is options_class}
        names = {field.name for field in dataclasses.fields(options_class)}
        assert filled <= names, f"{options_class.__name__} has no {sorted(filled - names)}"
        parsed_here = set(parsed) if options_class is MultiDocOptions else set()
        assert sorted(names - filled - parsed_here) == sorted(exempt), options_class.__name__


@pytest.mark.parametrize(("table", "not_options", "parsed"), TABLES)
def test_an_option_filling_several_fields_has_one_default(
    table: Sequence[CliOption], not_options: Mapping[type, tuple[str, ...]], parsed: Sequence[str]
) -> None:
    for option in table:
        defaults = {repr(target_default(target)) for target in option.targets}
        assert len(defaults) <= 1, f"{option.flag}: its fields' defaults differ: {defaults}"


def test_the_parsed_multidoc_options_default_to_the_fields_defaults() -> None:
    options = {option.name: option for option in bench_multidoc_options.MULTIDOC_OPTIONS}
    defaults = MultiDocOptions()
    assert parse_tiers(str(options["tiers"].default)) == defaults.tiers
    assert tuple(BenchMode(mode) for mode in str(options["modes"].default).split(",")) == defaults.modes
    assert options["cpu_capacity"].default is None and defaults.cpu_capacity_bytes is None
    assert options["gpu_capacity"].default is None and defaults.gpu_capacity_bytes is None


@pytest.mark.parametrize(
    ("command", "table"),
    [
        (bench_vllm_command, bench_vllm_options.BENCH_VLLM_OPTIONS),
        (multi_doc_qa_command, bench_multidoc_options.MULTIDOC_OPTIONS),
        (shuffle_command, bench_multidoc_options.MULTIDOC_OPTIONS),
    ],
)
def test_the_command_takes_the_declared_options_in_order(
    command: Callable[..., None], table: Sequence[CliOption]
) -> None:
    app = typer.Typer(rich_markup_mode=None, add_completion=False)
    app.command("bench")(command)
    params = typer.main.get_command(app).params
    assert [(param.name, param.opts[0], param.default) for param in params] == [
        (option.name, option.flag, option.default_value()) for option in table
    ]

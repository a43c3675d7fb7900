"""Issue 26's command matrix: every family of tests/tiny_models.MATRIX through every cell of tests/family_cells.py
(train native and TRL, displacement by tensor, module, layer and --spectral, shift, attribute, recommend and
training its refined config, report, eval), each checked against an independent computation there."""

from __future__ import annotations

import pytest
import torch

from tests import family_cells as cells
from tests.tiny_models import MATRIX

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=MATRIX)
def fam(request, tmp_path_factory):
    """One family's model folder and its two trained runs (native, TRL), shared by every cell."""
    return cells.family_runs(request.param, tmp_path_factory.mktemp(request.param))


def test_train_native_and_trl_record_exact_displacement(fam):
    _, folder, runs, _ = fam
    cells.check_train_records(folder, runs)


def test_displacement_by_tensor_module_layer_and_spectral(fam):
    _, folder, runs, _ = fam
    cells.check_displacement(folder, runs["native"])


def test_shift_lens_and_output_kl_are_the_models_own(fam):
    _, folder, runs, tmp = fam
    cells.check_shift(folder, runs["native"], tmp)


def test_attribute_reference_rows_are_the_summary(fam):
    _, _, runs, _ = fam
    cells.check_attribute(runs)


def test_recommend_then_train_its_refined_config(fam):
    _, folder, runs, tmp = fam
    cells.check_recommend_train(folder, runs["native"], tmp)


def test_report_shows_the_recorded_module_mass(fam):
    _, folder, runs, tmp = fam
    cells.check_report(folder, runs, tmp)


def test_eval_reproduces_the_runs_base_and_final_accuracy(fam):
    _, folder, runs, tmp = fam
    cells.check_eval(folder, runs["native"], tmp)

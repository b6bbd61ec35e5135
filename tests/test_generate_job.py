"""`+job=generate` on a user's own Parquet with nothing but a prompt column: one output row per
input row, ids = row positions, one task; and clear errors for what it needs."""
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from pipeline.data import read_stats
from pipeline.recipes import CONF_DIR
from pipeline.run import register_resolvers, run_recipe

QUESTIONS = ["What is a list?", "How do I open a file?", "Why use a dict?", "What is None?",
             "What does len do?"]


def run_job(overrides):
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return run_recipe(compose(config_name="config", overrides=["+job=generate", *overrides]))


@pytest.fixture
def questions(tmp_path):
    path = tmp_path / "questions.parquet"
    pq.write_table(pa.table({"question": QUESTIONS}), path)
    return path


def test_generate_on_a_file_with_one_string_column(questions, tmp_path):
    pytest.importorskip("ray")
    run_dir = tmp_path / "run"
    status = run_job([f"data.path={questions}", "data.prompt_column=question", "data.limit=4",
                      "sampling.max_new_tokens=4", f"output.dir={run_dir}", "cluster.cpus_per_actor=1",
                      "engine.max_batch_size=4"])        # the shipped demo model (model.path's default)
    assert status == 0
    table = ds.dataset(str(run_dir / "outputs"), format="parquet").to_table().sort_by("id")
    assert table["id"].to_pylist() == [0, 1, 2, 3]                  # one row per input row, by position
    assert table["prompt"].to_pylist() == QUESTIONS[:4]
    assert table["error"].null_count == 4 and all(n > 0 for n in table["num_generated_tokens"].to_pylist())
    stats = read_stats(run_dir)
    assert set(stats["task"].to_pylist()) == {"default"}             # no task column: one task
    assert (run_dir / "report.html").is_file()                      # the recipe drew the dashboard


def test_generate_names_what_it_needs(questions, tmp_path, capsys):
    assert run_job([f"output.dir={tmp_path / 'a'}"]) == 1
    assert "data.path is required" in capsys.readouterr().err
    assert run_job([f"data.path={questions}", f"output.dir={tmp_path / 'b'}"]) == 1
    assert "set data.prompt_column or data.template" in capsys.readouterr().err
    assert run_job([f"data.path={questions}", "data.prompt_column=text", f"output.dir={tmp_path / 'c'}"]) == 1
    assert "no column(s) ['text']" in capsys.readouterr().err
    assert not any((tmp_path / d / "report.html").exists() for d in "abc")

"""``python -m trainguard.dashboards.docs_tables``: where the docs it rewrites are not (an installed
trainguard, run outside a checkout), it says so and exits 2, writing nothing. The generated parts
themselves are checked against the pages in tests/docs."""

from __future__ import annotations

import pytest

from trainguard.dashboards import docs_tables


@pytest.mark.parametrize("check", [False, True])
def test_a_folder_without_the_docs_is_an_error_naming_it(tmp_path, capsys, check) -> None:
    with pytest.raises(SystemExit) as stopped:
        docs_tables.main(["--docs", str(tmp_path), *(["--check"] if check else [])])
    assert stopped.value.code == 2
    first = next(iter(docs_tables.BLOCKS))
    err = capsys.readouterr().err
    assert f"{tmp_path / first} is not there: run it in the repository's root, or name the docs folder with --docs" in err
    assert list(tmp_path.iterdir()) == []

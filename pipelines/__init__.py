"""The jobs, imported as ``prx_data.pipelines.<job>``. Each module plans and runs one job on
the one runtime (:mod:`prx_data.core.runtime`); the CLIs in ``prx_data.cli`` parse
arguments and call these.

This folder installs as ``prx_data.pipelines`` (pyproject.toml, ``package-dir``), and
``prx_data/pipelines/__init__.py`` points a source checkout here, so each job has one
import name: a second one would load its module twice.
"""

if __name__ == "pipelines":
    raise ImportError(
        "the jobs are prx_data.pipelines.<job>: import prx_data.pipelines.write_mds, "
        "not pipelines.write_mds"
    )

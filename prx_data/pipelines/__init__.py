"""The jobs, ``prx_data.pipelines.<job>``, kept in the top-level ``pipelines/`` folder.

An installed wheel holds that folder here (``package-dir`` in pyproject.toml);
in a source checkout this package points at it, so the jobs have one import
name either way. Importing them as a top-level ``pipelines`` is refused
(``pipelines/__init__.py``): two names would load each job twice.
"""

import os as _os

_HERE = _os.path.dirname(_os.path.abspath(__file__))
__path__ = [_os.path.join(_os.path.dirname(_os.path.dirname(_HERE)), "pipelines")]

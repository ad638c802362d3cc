"""Only here to ship ``ds_nvfp4_autohook.pth`` into site-packages, for wheel and editable installs alike.

Everything else is in pyproject.toml. Python runs the ``.pth`` file at interpreter start; it makes an unmodified
``deepspeed.initialize`` honour the ds_config's ``precision`` section (see ds_nvfp4_autohook.py).
"""

import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "ds_nvfp4_autohook.pth"
HERE = Path(__file__).resolve().parent


class build_py_with_pth(build_py):
    """Wheels: copy the start-up file to the root of the build (the wheel's purelib root is site-packages)."""

    def run(self) -> None:
        super().run()
        self.copy_file(str(HERE / PTH), os.path.join(self.build_lib, PTH))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), os.path.join(self.build_lib, PTH)]


class editable_wheel_with_pth(editable_wheel):
    """``pip install -e``: the editable wheel holds only setuptools' own finder ``.pth``; add ours beside it.

    Its name sorts after ``__editable__...pth``, so the finder that makes ``ds_nvfp4_autohook`` importable from
    the source tree is installed before our file runs.
    """

    def _select_strategy(self, name, tag, build_lib):
        strategy = super()._select_strategy(name, tag, build_lib)

        class WithPth:
            def __enter__(self):
                strategy.__enter__()
                return self

            def __exit__(self, *exc):
                return strategy.__exit__(*exc)

            def __call__(self, wheel, files, mapping):
                strategy(wheel, files, mapping)
                wheel.writestr(PTH, (HERE / PTH).read_bytes())

        return WithPth()


setup(cmdclass={"build_py": build_py_with_pth, "editable_wheel": editable_wheel_with_pth})

"""The one compiled part: the allocator's tree fold (devplugin/policy/_foldc.c).

Optional by default: where it cannot be built the package still installs,
the allocator uses its Python fold (the same answers, slower) and the daemon
warns at start.
"""

import os

from setuptools import Extension, setup

# The image build sets this: a wheel without the compiled fold must fail
# there rather than ship slow.
REQUIRED = os.environ.get("DEVPLUGIN_REQUIRE_NATIVE") == "1"

setup(
    ext_modules=[
        Extension(
            "devplugin.policy._foldc",
            sources=["devplugin/policy/_foldc.c"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wextra", "-Werror=implicit"],
            optional=not REQUIRED,
        )
    ]
)

#!/usr/bin/env bash
# TRL and the packages it needs that the device's image lacks, as wheels in .wheels/ (ignored by
# git), for gpu_session.sh's W3 against TRL: the device reaches no package registry, so a call
# carries them (run's carry: [".wheels"]). TRL's version is read from pyproject.toml's bench extra;
# datasets (which TRL needs), dill and multiprocess (which datasets needs) are not in the image.
set -eu
cd "$(dirname "$0")/.."
trl=$(python3 -c "import tomllib
bench = tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['bench']
print(next(r for r in bench if r.startswith('trl')))")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .wheels "$trl" datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
ls .wheels

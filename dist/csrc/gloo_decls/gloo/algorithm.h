// Declarations only: see ../README.md. Nothing from gloo/algorithm.h is used by the shim.
#pragma once

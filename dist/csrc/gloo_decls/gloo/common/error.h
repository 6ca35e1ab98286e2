// Declarations only: see ../../README.md. Nothing from gloo/common/error.h is used by the shim.
#pragma once

// Declarations only: see ../../README.md. ProcessGroupGloo.hpp holds these behind smart pointers.
#pragma once

namespace gloo {
namespace transport {
class Device;
class UnboundBuffer;
} // namespace transport
} // namespace gloo

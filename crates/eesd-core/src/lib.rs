//! eesd-core

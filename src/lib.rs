//! eesd

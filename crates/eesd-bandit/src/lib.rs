//! eesd-bandit

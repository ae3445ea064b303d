//! Priority classes: their configuration, its checks, and the slots their shares come to.
//!
//! A class is named, ordered (the first is the most important) and has two shares of the
//! ceiling: `min_share`, guaranteed, and `max_share`, a hard cap. Shares are fractions; the
//! queue works in slots, recomputed whenever the ceiling moves (an adaptive limit, a
//! reconfigure): a guarantee is `floor(min_share * ceiling)`, at least one slot when
//! `min_share > 0`; a cap is `floor(max_share * ceiling)`, at least one slot. A gate without
//! classes has one implicit class with no guarantee and no cap below the ceiling.

use std::fmt;
use std::sync::Arc;

/// The most classes a gate takes: the queue keeps one bit per class in its masks.
pub const MAX_CLASSES: usize = 64;

/// Shares may sum to 1 plus this much: what adding a few decimal fractions in floating point
/// can overshoot by (0.1 + 0.2 + 0.7 is 1.0000000000000002).
const SUM_TOLERANCE: f64 = 1e-9;

/// Added before flooring a share of the ceiling, so 0.29 * 100 (28.999999999999996) is 29.
const FLOOR_TOLERANCE: f64 = 1e-9;

/// A class's position, 0 being the most important. [`ClassId::DEFAULT`] names the gate's
/// default class, whatever its position (what callers that know no class pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClassId(pub u8);

impl ClassId {
    /// The gate's default class.
    pub const DEFAULT: ClassId = ClassId(u8::MAX);
}

/// One priority class as configured.
#[derive(Clone, Debug, PartialEq)]
pub struct PriorityClass {
    /// Its name, as `admit(priority=...)` gives it.
    pub name: Arc<str>,
    /// The guaranteed fraction of the ceiling.
    pub min_share: f64,
    /// The most of the ceiling it may hold.
    pub max_share: f64,
}

impl PriorityClass {
    /// A class with no guarantee and no cap.
    pub fn new(name: &str) -> Self {
        Self::shared(name, 0.0, 1.0)
    }

    /// A class with shares (checked by [`Priorities::new`]).
    pub fn shared(name: &str, min_share: f64, max_share: f64) -> Self {
        Self {
            name: Arc::from(name),
            min_share,
            max_share,
        }
    }
}

/// A priority configuration the core refuses; the message names the argument and the value.
#[derive(Clone, Debug, PartialEq)]
pub enum PriorityError {
    /// `priorities=` was given but empty.
    Empty,
    /// More than [`MAX_CLASSES`] classes.
    TooMany(usize),
    /// A class name that is empty.
    EmptyName,
    /// Two classes with one name.
    Duplicate(Arc<str>),
    /// A share that is not a number in `[0, 1]`.
    Share {
        /// The class.
        class: Arc<str>,
        /// `min_share` or `max_share`.
        arg: &'static str,
        /// The value given.
        value: f64,
    },
    /// `min_share > max_share`.
    Inverted {
        /// The class.
        class: Arc<str>,
        /// Its `min_share`.
        min_share: f64,
        /// Its `max_share`.
        max_share: f64,
    },
    /// Guarantees summing above 1.
    Oversubscribed(f64),
    /// `default_priority` names no class.
    UnknownDefault {
        /// The name given.
        name: String,
        /// The classes' names.
        known: Vec<Arc<str>>,
    },
    /// A reconfiguration that renames, adds, removes or reorders classes.
    Renamed,
}

impl fmt::Display for PriorityError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PriorityError::Empty => f.write_str("priorities must name at least one class"),
            PriorityError::TooMany(n) => {
                write!(f, "priorities takes at most {MAX_CLASSES} classes, got {n}")
            }
            PriorityError::EmptyName => f.write_str("a priority class name must not be empty"),
            PriorityError::Duplicate(name) => {
                write!(f, "priorities names the class {} twice", quote(name))
            }
            PriorityError::Share { class, arg, value } => write!(
                f,
                "{arg} of priority class {} must be a number from 0 to 1, got {value:?}",
                quote(class)
            ),
            PriorityError::Inverted {
                class,
                min_share,
                max_share,
            } => write!(
                f,
                "min_share ({min_share:?}) of priority class {} must be <= its max_share \
                 ({max_share:?})",
                quote(class)
            ),
            PriorityError::Oversubscribed(sum) => write!(
                f,
                "the priority classes' min_share values sum to {sum:?}; guarantees cannot exceed \
                 the whole limit (1.0)"
            ),
            PriorityError::UnknownDefault { name, known } => write!(
                f,
                "default_priority {} is not a priority class; known: {}",
                quote(name),
                names(known)
            ),
            PriorityError::Renamed => f.write_str(
                "reconfigure may change the priority classes' shares, not their names or order",
            ),
        }
    }
}

impl std::error::Error for PriorityError {}

/// `'a', 'b'`: names as an error message lists them.
pub fn names(known: &[Arc<str>]) -> String {
    known
        .iter()
        .map(|name| quote(name))
        .collect::<Vec<_>>()
        .join(", ")
}

/// A name in single quotes, as Python's `repr` shows a string the user typed.
pub fn quote(name: &str) -> String {
    format!("'{}'", name.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// A checked list of classes, most important first, with the default one.
#[derive(Clone, Debug, PartialEq)]
pub struct Priorities {
    classes: Vec<PriorityClass>,
    default: u8,
}

impl Default for Priorities {
    /// A gate without classes: one class, no guarantee, no cap.
    fn default() -> Self {
        Self {
            classes: vec![PriorityClass::new("default")],
            default: 0,
        }
    }
}

impl Priorities {
    /// Checks `classes` (most important first) and `default` (a class's name; the last class
    /// when `None`).
    pub fn new(classes: Vec<PriorityClass>, default: Option<&str>) -> Result<Self, PriorityError> {
        if classes.is_empty() {
            return Err(PriorityError::Empty);
        }
        if classes.len() > MAX_CLASSES {
            return Err(PriorityError::TooMany(classes.len()));
        }
        let mut sum = 0.0;
        for (i, class) in classes.iter().enumerate() {
            if class.name.is_empty() {
                return Err(PriorityError::EmptyName);
            }
            if classes.iter().take(i).any(|other| other.name == class.name) {
                return Err(PriorityError::Duplicate(class.name.clone()));
            }
            for (arg, value) in [
                ("min_share", class.min_share),
                ("max_share", class.max_share),
            ] {
                if !(0.0..=1.0).contains(&value) {
                    return Err(PriorityError::Share {
                        class: class.name.clone(),
                        arg,
                        value,
                    });
                }
            }
            if class.min_share > class.max_share {
                return Err(PriorityError::Inverted {
                    class: class.name.clone(),
                    min_share: class.min_share,
                    max_share: class.max_share,
                });
            }
            sum += class.min_share;
        }
        if sum > 1.0 + SUM_TOLERANCE {
            return Err(PriorityError::Oversubscribed(sum));
        }
        let last = classes.len().saturating_sub(1);
        let default = match default {
            None => last,
            Some(name) => classes
                .iter()
                .position(|class| &*class.name == name)
                .ok_or_else(|| PriorityError::UnknownDefault {
                    name: name.to_owned(),
                    known: classes.iter().map(|class| class.name.clone()).collect(),
                })?,
        };
        Ok(Self {
            classes,
            // At most `MAX_CLASSES` (64) classes: every position fits.
            default: u8::try_from(default).unwrap_or(u8::MAX),
        })
    }

    /// The classes, most important first.
    pub fn classes(&self) -> &[PriorityClass] {
        &self.classes
    }

    /// The default class.
    pub fn default_class(&self) -> ClassId {
        ClassId(self.default)
    }

    /// The class named `name`.
    pub fn find(&self, name: &str) -> Option<ClassId> {
        let position = self.classes.iter().position(|c| &*c.name == name)?;
        u8::try_from(position).ok().map(ClassId)
    }

    /// The classes' names, most important first.
    pub fn names(&self) -> Vec<Arc<str>> {
        self.classes.iter().map(|c| c.name.clone()).collect()
    }

    /// Whether `other` has the same classes in the same order (shares may differ).
    pub fn same_names(&self, other: &Priorities) -> bool {
        self.classes.len() == other.classes.len()
            && self
                .classes
                .iter()
                .zip(&other.classes)
                .all(|(a, b)| a.name == b.name)
    }

    /// `class` as a position (the default class for [`ClassId::DEFAULT`] or any position past
    /// the last class).
    pub fn resolve(&self, class: ClassId) -> usize {
        let position = usize::from(class.0);
        if position < self.classes.len() {
            position
        } else {
            usize::from(self.default)
        }
    }

    /// Whether this is a gate without classes (one class, no guarantee, no cap).
    pub fn is_plain(&self) -> bool {
        self.classes.len() == 1
            && self
                .classes
                .first()
                .is_some_and(|c| c.min_share == 0.0 && c.max_share >= 1.0)
    }
}

/// One class's shares in slots under some ceiling.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slots {
    /// Slots it is guaranteed.
    pub guarantee: u64,
    /// The most slots it may hold (`u64::MAX`: no cap).
    pub cap: u64,
}

/// `floor(share * ceiling)`, forgiving float rounding.
fn share_of(share: f64, ceiling: u32) -> u64 {
    let slots = (share * f64::from(ceiling) + FLOOR_TOLERANCE).floor();
    // In [0, ceiling]: the cast cannot truncate.
    if slots <= 0.0 {
        0
    } else {
        (slots as u64).min(u64::from(ceiling))
    }
}

impl PriorityClass {
    /// Its shares in slots under `ceiling` (0: no ceiling, so no guarantee and no cap).
    pub fn slots(&self, ceiling: u32) -> Slots {
        if ceiling == 0 {
            return Slots {
                guarantee: 0,
                cap: u64::MAX,
            };
        }
        let guarantee = match share_of(self.min_share, ceiling) {
            0 if self.min_share > 0.0 => 1,
            slots => slots,
        };
        Slots {
            guarantee,
            cap: share_of(self.max_share, ceiling).max(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(classes: Vec<PriorityClass>, default: Option<&str>) -> String {
        Priorities::new(classes, default).unwrap_err().to_string()
    }

    #[test]
    fn shares_become_slots_as_the_ceiling_moves() {
        let batch = PriorityClass::shared("batch", 0.2, 0.5);
        assert_eq!(
            batch.slots(16),
            Slots {
                guarantee: 3,
                cap: 8
            }
        );
        assert_eq!(
            batch.slots(4),
            Slots {
                guarantee: 1,
                cap: 2
            },
            "at least one slot"
        );
        assert_eq!(
            batch.slots(1),
            Slots {
                guarantee: 1,
                cap: 1
            }
        );
        assert_eq!(batch.slots(0).cap, u64::MAX, "no ceiling, no cap");
        let rounding = PriorityClass::shared("x", 0.29, 0.29);
        assert_eq!(
            rounding.slots(100),
            Slots {
                guarantee: 29,
                cap: 29
            }
        );
        let tiny = PriorityClass::shared("y", 0.0, 0.01);
        assert_eq!(
            tiny.slots(10),
            Slots {
                guarantee: 0,
                cap: 1
            },
            "a cap of one slot at least"
        );
        assert_eq!(
            PriorityClass::new("z").slots(7),
            Slots {
                guarantee: 0,
                cap: 7
            }
        );
    }

    #[test]
    fn bad_configurations_are_refused_with_their_names() {
        let c = PriorityClass::shared;
        assert_eq!(err(vec![], None), "priorities must name at least one class");
        assert!(err(vec![c("a", 0.5, 1.0), c("a", 0.1, 1.0)], None).contains("'a' twice"));
        assert!(err(vec![c("a", 0.6, 0.5)], None).contains("min_share (0.6)"));
        assert!(err(vec![c("a", 0.6, 1.0), c("b", 0.5, 1.0)], None).contains("sum to 1.1"));
        assert!(err(vec![c("a", -0.1, 1.0)], None).contains("got -0.1"));
        assert!(err(vec![c("a", f64::NAN, 1.0)], None).contains("min_share"));
        assert!(err(vec![c("a", 0.0, 1.5)], None).contains("max_share"));
        assert!(err(vec![c("", 0.0, 1.0)], None).contains("empty"));
        let unknown = err(vec![c("a", 0.0, 1.0), c("b", 0.0, 1.0)], Some("c"));
        assert_eq!(
            unknown,
            "default_priority 'c' is not a priority class; known: 'a', 'b'"
        );
        // Rounding is forgiven.
        assert!(Priorities::new(
            vec![c("a", 0.1, 1.0), c("b", 0.2, 1.0), c("c", 0.7, 1.0)],
            None
        )
        .is_ok());
        let many = (0..65).map(|i| c(&format!("c{i}"), 0.0, 1.0)).collect();
        assert!(err(many, None).contains("at most 64"));
    }

    #[test]
    fn the_default_is_the_last_class_unless_named() {
        let c = PriorityClass::new;
        let p = Priorities::new(vec![c("hi"), c("lo")], None).unwrap();
        assert_eq!(p.default_class(), ClassId(1));
        assert_eq!(p.resolve(ClassId::DEFAULT), 1);
        assert_eq!(p.find("hi"), Some(ClassId(0)));
        let p = Priorities::new(vec![c("hi"), c("lo")], Some("hi")).unwrap();
        assert_eq!(p.resolve(ClassId::DEFAULT), 0);
        assert!(Priorities::default().is_plain());
        assert!(!p.is_plain());
    }
}

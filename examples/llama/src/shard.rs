//! A share of the work of several processes: `index` of `count` (`--shard 1/4` on the command
//! line is index 1 of 4, 0-based). Shards are contiguous and balanced: the first `len % count`
//! shards hold one item more. Concatenated in index order, the shards are the whole.

use anyhow::{Result, bail};
use std::ops::Range;

/// Shard `index` of `count` (read from a file, it is checked as [`Shard::new`] checks it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "ShardFields")]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

/// A shard as written in a file, before its check.
#[derive(serde::Deserialize)]
struct ShardFields {
    index: usize,
    count: usize,
}

impl TryFrom<ShardFields> for Shard {
    type Error = String;

    fn try_from(f: ShardFields) -> Result<Self, String> {
        Self::new(f.index, f.count).map_err(|e| e.to_string())
    }
}

impl Shard {
    /// The whole: shard 0 of 1.
    pub const WHOLE: Self = Self { index: 0, count: 1 };

    /// Shard `index` of `count`; `count` must be >= 1 and `index < count`.
    pub fn new(index: usize, count: usize) -> Result<Self> {
        if count == 0 {
            bail!("a shard count must be >= 1, got 0");
        }
        if index >= count {
            bail!("shard {index} of {count} does not exist (shards are numbered 0..{count})");
        }
        Ok(Self { index, count })
    }

    /// Whether this is the whole (one shard).
    pub fn is_whole(&self) -> bool {
        self.count == 1
    }

    /// `what`, naming the shard when there are several (progress lines of data-parallel ranks).
    ///
    /// ```
    /// use topr_llama::shard::Shard;
    /// assert_eq!(Shard::WHOLE.label("sample"), "sample");
    /// assert_eq!(Shard::new(1, 4).unwrap().label("sample"), "sample (shard 1/4)");
    /// ```
    pub fn label(&self, what: &str) -> String {
        if self.is_whole() { what.to_string() } else { format!("{what} (shard {self})") }
    }

    /// This shard's items of `0..len`.
    ///
    /// ```
    /// use topr_llama::shard::Shard;
    /// let parts: Vec<_> = (0..3).map(|i| Shard::new(i, 3).unwrap().range(7)).collect();
    /// assert_eq!(parts, vec![0..3, 3..5, 5..7]);
    /// ```
    pub fn range(&self, len: usize) -> Range<usize> {
        let (base, extra) = (len / self.count, len % self.count);
        let start = self.index * base + self.index.min(extra);
        start..start + base + usize::from(self.index < extra)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = anyhow::Error;

    /// `i/n`, 0-based: `0/2` and `1/2` are the two halves.
    fn from_str(s: &str) -> Result<Self> {
        let Some((i, n)) = s.split_once('/') else { bail!("expected INDEX/COUNT (like 0/2), got {s:?}") };
        let parse = |v: &str, what: &str| {
            v.trim().parse::<usize>().map_err(|e| anyhow::anyhow!("{s:?}: the {what} {v:?} is not a number ({e})"))
        };
        Self::new(parse(i, "index")?, parse(n, "count")?)
    }
}

#[cfg(test)]
mod tests {
    use super::Shard;

    #[test]
    fn shards_cover_the_whole_in_order() {
        for len in 0..20 {
            for count in 1..6 {
                let ranges: Vec<_> = (0..count).map(|i| Shard::new(i, count).unwrap().range(len)).collect();
                assert_eq!(ranges[0].start, 0);
                assert_eq!(ranges[count - 1].end, len);
                for w in ranges.windows(2) {
                    assert_eq!(w[0].end, w[1].start);
                    assert!(w[0].len() >= w[1].len() && w[0].len() <= w[1].len() + 1);
                }
            }
        }
    }

    #[test]
    fn bad_shards_are_refused() {
        assert!("2/2".parse::<Shard>().unwrap_err().to_string().contains("0..2"));
        assert!("1/0".parse::<Shard>().is_err());
        assert!("x/2".parse::<Shard>().unwrap_err().to_string().contains("index"));
        assert!("1".parse::<Shard>().is_err());
        assert_eq!("1/3".parse::<Shard>().unwrap(), Shard { index: 1, count: 3 });
        // Read from a file, a shard is checked too.
        assert!(serde_json::from_str::<Shard>(r#"{"index": 2, "count": 2}"#).is_err());
        assert!(serde_json::from_str::<Shard>(r#"{"index": 0, "count": 0}"#).is_err());
        assert_eq!(serde_json::from_str::<Shard>(r#"{"index": 1, "count": 2}"#).unwrap(), Shard { index: 1, count: 2 });
    }
}

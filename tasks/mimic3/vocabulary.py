"""Word lists of the synthetic MIMIC-III generator: ICD-9 codes with their
surface forms and evidence, note sections and sentence frames."""

from __future__ import annotations

DIAGNOSES = [
    ("4019", ["hypertension", "htn", "elevated blood pressures"], ["lisinopril", "amlodipine"]),
    (
        "4280",
        ["congestive heart failure", "chf", "cardiac decompensation"],
        ["furosemide", "lasix"],
    ),
    (
        "42731",
        ["atrial fibrillation", "afib", "irregularly irregular rhythm"],
        ["diltiazem", "amiodarone"],
    ),
    (
        "41401",
        ["coronary artery disease", "cad", "coronary atherosclerosis"],
        ["clopidogrel", "nitroglycerin"],
    ),
    ("5849", ["acute kidney injury", "arf", "acute renal insufficiency"], ["rising creatinine"]),
    (
        "25000",
        ["type 2 diabetes", "dm2", "non-insulin dependent diabetes"],
        ["metformin", "glipizide"],
    ),
    ("2724", ["hyperlipidemia", "hld", "dyslipidemia"], ["atorvastatin", "simvastatin"]),
    (
        "51881",
        ["acute respiratory failure", "hypoxic respiratory failure", "ventilatory failure"],
        ["intubated for hypoxia"],
    ),
    (
        "5990",
        ["urinary tract infection", "uti", "cystitis"],
        ["nitrofurantoin", "positive urine culture"],
    ),
    (
        "486",
        ["pneumonia", "pna", "lobar consolidation"],
        ["levofloxacin", "infiltrate on chest x-ray"],
    ),
    (
        "0389",
        ["septicemia", "sepsis", "bloodstream infection with shock physiology"],
        ["blood cultures grew gram negative rods"],
    ),
    ("2859", ["anemia", "low hemoglobin", "reduced red cell mass"], ["transfused one unit"]),
    (
        "496",
        ["copd", "chronic obstructive pulmonary disease", "emphysema"],
        ["tiotropium", "ipratropium nebs"],
    ),
    ("3051", ["tobacco use", "active smoker", "cigarette dependence"], ["nicotine patch"]),
    (
        "2449",
        ["hypothyroidism", "hypothyroid", "underactive thyroid"],
        ["levothyroxine", "synthroid"],
    ),
    ("53081", ["gastroesophageal reflux", "gerd", "acid reflux"], ["omeprazole", "pantoprazole"]),
    (
        "V5861",
        ["long term anticoagulation", "chronic anticoagulation", "maintained on blood thinners"],
        ["warfarin", "coumadin"],
    ),
    ("2761", ["hyponatremia", "low sodium", "hypoosmolality"], ["fluid restriction"]),
    ("2762", ["metabolic acidosis", "acidosis", "acidemia"], ["bicarbonate drip"]),
    (
        "2875",
        ["thrombocytopenia", "low platelets", "platelet deficiency"],
        ["platelet transfusion"],
    ),
    (
        "40390",
        ["hypertensive kidney disease", "hypertensive nephropathy", "hypertensive nephrosclerosis"],
        [],
    ),
    (
        "5859",
        ["chronic kidney disease", "ckd", "chronic renal insufficiency"],
        ["baseline creatinine of 2"],
    ),
    ("412", ["old myocardial infarction", "prior mi", "remote infarct"], []),
    (
        "41071",
        ["nstemi", "non st elevation mi", "subendocardial infarction"],
        ["troponin peaked", "heparin drip"],
    ),
    ("4240", ["mitral regurgitation", "mr", "mitral valve insufficiency"], []),
    ("4241", ["aortic stenosis", "as", "calcific aortic valve disease"], []),
    (
        "311",
        ["depression", "depressive disorder", "low mood disorder"],
        ["sertraline", "citalopram"],
    ),
    (
        "2930",
        ["delirium", "acute confusional state", "acute encephalopathy with confusion"],
        ["haloperidol"],
    ),
    ("2809", ["iron deficiency anemia", "ida", "iron poor blood"], ["ferrous sulfate"]),
    (
        "5070",
        ["aspiration pneumonitis", "aspiration pneumonia", "chemical pneumonitis"],
        ["swallow study failed"],
    ),
    ("4589", ["hypotension", "low blood pressure", "hemodynamic instability"], ["fluid boluses"]),
    ("78552", ["septic shock", "shock", "distributive shock"], ["norepinephrine", "levophed"]),
    (
        "99592",
        ["severe sepsis", "sepsis with organ dysfunction", "sepsis with end organ damage"],
        [],
    ),
    ("5789", ["gi bleed", "gastrointestinal hemorrhage", "melena with hemoglobin drop"], ["egd"]),
    (
        "5715",
        ["cirrhosis", "cirrhosis of liver", "end stage liver disease"],
        ["lactulose", "rifaximin"],
    ),
    ("34590", ["epilepsy", "seizure disorder", "recurrent seizures"], ["levetiracetam", "keppra"]),
    ("43491", ["ischemic stroke", "cva", "cerebral infarction"], ["tpa"]),
    (
        "4168",
        ["pulmonary hypertension", "pulm htn", "elevated pulmonary pressures"],
        ["sildenafil"],
    ),
    (
        "E8782",
        ["complication of anastomosis", "post procedural complication", "surgical misadventure"],
        [],
    ),
    (
        "E9342",
        ["adverse effect of anticoagulant", "supratherapeutic inr", "coumadin toxicity"],
        ["vitamin k"],
    ),
    ("V1582", ["history of tobacco use", "former smoker", "quit smoking years ago"], []),
    ("V4501", ["cardiac pacemaker in situ", "pacemaker", "permanent pacer"], []),
    ("27800", ["obesity", "obese", "elevated body mass index"], []),
    ("32723", ["obstructive sleep apnea", "osa", "sleep disordered breathing"], ["cpap at night"]),
    ("73300", ["osteoporosis", "low bone density", "osteopenia severe"], ["alendronate"]),
    (
        "2639",
        ["malnutrition", "protein calorie malnutrition", "poor nutritional status"],
        ["tube feeds"],
    ),
    ("5119", ["pleural effusion", "effusion", "fluid in the pleural space"], ["thoracentesis"]),
    ("2767", ["hyperkalemia", "high potassium", "elevated serum potassium"], ["kayexalate"]),
    ("2768", ["hypokalemia", "low potassium", "potassium depletion"], ["potassium repletion"]),
    ("1628", ["lung cancer", "nsclc", "bronchogenic carcinoma"], ["carboplatin"]),
    ("42789", ["arrhythmia", "dysrhythmia", "conduction abnormality"], []),
    ("4271", ["ventricular tachycardia", "vt", "wide complex tachycardia"], ["lidocaine"]),
    (
        "5180",
        ["atelectasis", "pulmonary collapse", "collapsed lung segment"],
        ["incentive spirometry"],
    ),
    ("V4581", ["status post cabg", "s/p cabg", "prior bypass grafting"], []),
    (
        "2851",
        ["acute blood loss anemia", "posthemorrhagic anemia", "anemia from acute bleeding"],
        [],
    ),
    ("7907", ["bacteremia", "positive blood cultures", "bacteria in the blood"], []),
    ("V1251", ["history of dvt", "prior dvt", "previous venous thrombosis"], []),
    ("4660", ["acute bronchitis", "bronchitis", "inflamed bronchi"], []),
    ("5641", ["irritable bowel syndrome", "ibs", "functional bowel disorder"], ["dicyclomine"]),
    (
        "6826",
        ["cellulitis of leg", "leg cellulitis", "lower extremity soft tissue infection"],
        ["cefazolin"],
    ),
]
PROCEDURES = [
    ("9604", ["endotracheal intubation", "intubated", "airway secured with a tube"], []),
    ("9671", ["mechanical ventilation", "ventilator support", "vent dependent"], []),
    (
        "9672",
        [
            "prolonged mechanical ventilation",
            "ventilated for over four days",
            "extended ventilator course",
        ],
        [],
    ),
    ("3893", ["central venous catheter", "central line", "cvc placement"], []),
    ("9904", ["transfusion of packed cells", "prbc transfusion", "blood products given"], []),
    ("3995", ["hemodialysis", "hd", "renal replacement therapy"], []),
    ("8856", ["coronary angiography", "cardiac catheterization", "coronary arteriogram"], []),
    ("3722", ["left heart catheterization", "lhc", "left sided cath"], []),
    ("0066", ["angioplasty", "ptca", "balloon dilation of coronary artery"], []),
    ("4513", ["upper endoscopy", "egd", "esophagogastroduodenoscopy"], []),
    ("3891", ["arterial line", "a-line", "radial arterial catheter"], []),
    (
        "0045",
        ["insertion of one vascular stent", "single stent placed", "one drug eluting stent"],
        [],
    ),
    ("3324", ["bronchoscopy", "bronch", "airway endoscopy"], []),
    ("8872", ["echocardiogram", "tte", "cardiac ultrasound"], []),
    ("3491", ["thoracentesis", "pleural tap", "pleural fluid drainage"], []),
    ("9915", ["parenteral nutrition", "tpn", "iv nutrition"], []),
]
ALL_CODES = {code: ("diagnoses", forms, ev) for code, forms, ev in DIAGNOSES} | {
    code: ("procedures", forms, ev) for code, forms, ev in PROCEDURES
}

SECTIONS = [
    ("Chief Complaint:", "Past Medical History:", "Hospital Course:", "Discharge Diagnosis:"),
    ("CHIEF COMPLAINT:", "PMH:", "BRIEF HOSPITAL COURSE:", "FINAL DIAGNOSES:"),
    ("Reason for admission:", "Medical history:", "Course in hospital:", "Diagnoses at discharge:"),
]
FILLER = [
    "Patient is a {age} year old {sex} seen at [**Hospital1 18**] .",
    "Vitals on admission : T {t} HR {hr} BP {sbp}/{dbp} RR {rr} O2 sat {sat}% on RA .",
    "Seen by Dr. [**Last Name (STitle) {n}**] on [**{date}**] .",
    "Social history : lives with family , ambulates with a walker .",
    "Physical exam : alert , oriented , no acute distress .",
    "Labs on admission were notable as below .",
    "The patient was followed by the medicine team .",
    "Discharge condition : stable .",
    "Follow up with PCP Dr. [**First Name8 (NamePattern2) {n}**] in two weeks .",
]
NEGATIONS = [
    "no evidence of {f} .",
    "ruled out for {f} .",
    "denies history of {f} .",
    "negative for {f} .",
]
FAMILY = ["Family history : mother with {f} .", "Father had {f} ."]
MENTIONS = [
    "# {f} : managed as below .",
    "History of {f} .",
    "Found to have {f} .",
    "{f} , stable on admission .",
    "Treated for {f} during this stay .",
]
EVIDENCE = ["Started on {e} .", "Continued {e} .", "Notable for {e} .", "Received {e} ."]
